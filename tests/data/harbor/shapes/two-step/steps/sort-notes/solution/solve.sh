#!/bin/bash
sort -o /app/notes.txt /app/notes.txt
