#!/bin/bash
wc -l < /workspace/input.txt > /workspace/count.txt
