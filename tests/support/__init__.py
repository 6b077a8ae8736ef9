"""What the tests share: models, numerics, subprocess helpers, workers and fakes; no tests here."""
