#!/bin/bash
# The tests beside the work, run from the WORKDIR: pytest collects /app's conftest.py and ini files too.
mkdir -p /app/tests && cp /tests/test_outputs.py /app/tests/
cd /app
if python -m pytest -rA; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
