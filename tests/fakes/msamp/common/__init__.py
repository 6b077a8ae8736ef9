"""Stand-in for msamp.common (see tests/fakes/README.md)."""
