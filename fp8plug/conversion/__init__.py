"""A conversion in three stages, each reading only what the one before it made.

1. select (fp8plug.backends.select_for): which engine, and why (a Selection);
2. plan (fp8plug.recipe.plans.make_plan, once per selection; conversion/plan.py `plan_model`, once
   per model): the engine's frozen plan, then every decision about the model as data (a
   ConversionPlan: each module converting or staying and why, its experts, the settings, the log
   line's engine), with nothing changed yet;
3. apply (conversion/apply.py `apply_plan`): steps that carry the plan out (the engine's
   conversion, the experts, attention, the numerics watch, the log line) and decide nothing.

fp8plug.convert_model and fp8plug.Accelerator both take this path (docs/architecture.md).
"""
