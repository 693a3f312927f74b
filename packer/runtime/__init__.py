"""Code that runs inside the serving container; standard library, torch and zstandard only."""
