"""Which modules convert, and what every converted layer carries, for every engine."""
