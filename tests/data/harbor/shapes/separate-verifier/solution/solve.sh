#!/bin/bash
echo 'hello separate' > /app/answer.txt
