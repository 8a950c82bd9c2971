#!/bin/bash
# The merge job of examples/ci/slurm-array.sh, submitted with --dependency=afterany on the
# array and RESULTS set to its results folder: the leaderboard of every shard, and the
# gate, which refuse a missing shard, a point measured twice or a shard of another plan.
#SBATCH --job-name=pagedbench-merge
#SBATCH --time=00:20:00
#SBATCH --output=build/slurm-bench/merge-%j.out
set -euo pipefail
pagedbench report "$RESULTS"/shard-* --output "$RESULTS/leaderboard.md"
mkdir -p "$RESULTS/merged" && cp "$RESULTS"/shard-*/*.jsonl "$RESULTS/merged/"
pagedbench gate --baseline results/baselines --current "$RESULTS/merged"
