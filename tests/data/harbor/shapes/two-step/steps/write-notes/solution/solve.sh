#!/bin/bash
printf 'pear\napple\nfig\n' > /app/notes.txt
