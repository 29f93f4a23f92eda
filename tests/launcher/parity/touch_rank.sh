#!/bin/bash
# A --no-python worker for the torchrun parity tests: touches DIR/<RANK>.
FILE="$1/$RANK"
echo "creating $FILE"
touch "$FILE"
