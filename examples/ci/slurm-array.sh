#!/bin/bash
# One benchmark sweep over a Slurm job array: every task runs `pagedbench bench --shard
# auto`, which reads its index from SLURM_ARRAY_TASK_ID (counted from
# SLURM_ARRAY_TASK_MIN) and the count from SLURM_ARRAY_TASK_COUNT, into a folder of its
# own under one per array job. Submit it, then the merge job after every task, failed ones
# included:
#
#   jobid=$(sbatch --parsable examples/ci/slurm-array.sh)
#   sbatch --dependency=afterany:$jobid --export=ALL,RESULTS=build/slurm-bench/$jobid \
#       examples/ci/slurm-merge.sh
#
# docs/ci.md, "Shards", says what the merge checks.
#SBATCH --job-name=pagedbench-shard
#SBATCH --array=0-3
#SBATCH --gres=gpu:1
#SBATCH --time=01:30:00
#SBATCH --output=build/slurm-bench/%A/shard-%a.out
set -euo pipefail
export PAGEDBENCH_CACHE_DIR=${PAGEDBENCH_CACHE_DIR:-build}
RESULTS=build/slurm-bench/$SLURM_ARRAY_JOB_ID
pagedbench bench --device cuda --devices all --shard auto \
    --results-dir "$RESULTS/shard-$SLURM_ARRAY_TASK_ID" \
    --junit-xml "$RESULTS/shard-$SLURM_ARRAY_TASK_ID/bench.xml"
