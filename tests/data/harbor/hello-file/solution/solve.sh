#!/bin/bash
echo 'Hello, sandforge!' > /workspace/hello.txt
