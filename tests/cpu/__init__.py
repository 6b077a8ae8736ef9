"""CPU tests: unit and integration, run by CI."""
