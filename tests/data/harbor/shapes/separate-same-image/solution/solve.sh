#!/bin/bash
mkdir -p /app/out && echo 42 > /app/out/result.txt && echo "wrote the result" > /app/work.log
