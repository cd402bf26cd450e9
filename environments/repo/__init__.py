"""The repo environment: SWE-style bug fixing in generated Python packages, graded by hidden tests."""
