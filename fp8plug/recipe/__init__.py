"""The recipe: FP8RecipeKwargs, its environment variables, each scaling family's settings
(fp8plug.recipe.scalings), and the plan each engine reads."""

from fp8plug.recipe.kwargs import *  # noqa: F401,F403  (`from fp8plug.recipe import FP8RecipeKwargs`, as before)
