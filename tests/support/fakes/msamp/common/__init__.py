"""Stand-in for msamp.common (see tests/support/fakes/README.md)."""
