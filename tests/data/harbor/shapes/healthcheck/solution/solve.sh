#!/bin/bash
cat /run/service-token > /app/out.txt
