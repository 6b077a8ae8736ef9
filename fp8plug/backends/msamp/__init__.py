"""The `msamp` engine: Microsoft MS-AMP."""
