"""Mirror runs: purls and SBOMs to keys to warm."""
