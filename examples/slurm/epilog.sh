#!/bin/bash
# SLURM Epilog for lightning_ft jobs: a node that lightning_ft finds unhealthy drains itself.
#
# slurm.conf:  Epilog=/path/to/epilog.sh
#
# slurmd runs the Epilog (as SlurmdUser, usually root) on every node of a job when the job
# ends, before the node is given to another job, and drains the node when the Epilog exits
# non-zero. `lightning-ft health` exits 82 on an unhealthy node, so a job that ended with
# 82 (an unhealthy node stopped without saving, its peers saved) and is requeued through
# RequeueExit cannot land on that node again; an administrator resumes it after the repair
# (scontrol update nodename=NODE state=resume).
#
# Use the same probes as the jobs (LIGHTNING_FT_HEALTH_* variables, see docs/sigterm.md). slurmd
# starts the Epilog with few variables of its own, so set them here or in a wrapper:
#   LIGHTNING_FT_PYTHON   the Python that has lightning_ft installed
#   FT_EPILOG_MARKERS     marker files, space-separated; shell patterns are expanded
#                         (default: /run/lightning_ft/unhealthy)
#   FT_EPILOG_HEALTH_ARGS more `lightning-ft health` options, e.g. --no-accelerator on CPU
#                         nodes (the CUDA query imports torch: about a second)

PYTHON=${LIGHTNING_FT_PYTHON:-python3}
markers=()
for marker in ${FT_EPILOG_MARKERS:-/run/lightning_ft/unhealthy}; do  # unquoted on purpose: patterns
    markers+=(--marker "$marker")
done
read -r -a extra <<<"${FT_EPILOG_HEALTH_ARGS:-}"
echo "epilog: job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname)}: lightning-ft health ${extra[*]} ${markers[*]}"
exec "$PYTHON" -m lightning_ft.cli health "${extra[@]}" "${markers[@]}"
