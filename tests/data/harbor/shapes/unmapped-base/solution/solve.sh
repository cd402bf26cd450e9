#!/bin/bash
echo ready > /srv/app/status.txt
