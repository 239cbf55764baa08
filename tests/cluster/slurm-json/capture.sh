#!/bin/bash
# capture.sh OUTDIR -- the captures in this folder, taken on a fresh, idle 4-node cluster
# (Gres=gpu:4 per node; SLURM_CONF and the version's commands on PATH):
#   job 1: sbatch -N2 --gres=gpu:2 --cpus-per-gpu=1 --mem-per-gpu=500M --requeue, running
#          -> squeue-mem-per-gpu-running.json, scontrol-show-job-mem-per-gpu-running.{txt,json}
#   job 2: sbatch --hold -N1 --gres=gpu:1 --mem=1G, then scancel
#          -> squeue-held-then-cancelled.json, scontrol-show-job-held-then-cancelled.txt
#   job 1: scontrol requeuehold -> squeue-requeue-held.json, scontrol-show-job-requeue-held.txt,
#          squeue-format.txt (squeue -O with the reason and the per-GPU TRES strings)
#   both cancelled: every action the backends take, on a finished and on an unknown job
#          -> finished-job-actions.txt (output and exit code of each command)
set -u
OUT=$1; mkdir -p "$OUT"; W=${WORK:-/tmp/slurm-json-capture}; mkdir -p "$W"; cd "$W"
printf '#!/bin/bash\nsleep 600\n' > job.sh; chmod +x job.sh
a=$(sbatch --parsable -N2 --gres=gpu:2 --cpus-per-gpu=1 --mem-per-gpu=500M --requeue -o "$W/o-%j" job.sh)
h=$(sbatch --parsable --hold -N1 --gres=gpu:1 --mem=1G -o "$W/o-%j" job.sh)
for _ in $(seq 30); do squeue -h -j "$a" -o %T | grep -q RUNNING && break; sleep 1; done
squeue --json --all --states=all > "$OUT/squeue-mem-per-gpu-running.json"
scontrol -d show job "$a" > "$OUT/scontrol-show-job-mem-per-gpu-running.txt"
# scontrol --json exists from 23.02 only
scontrol show job "$a" --json > "$OUT/scontrol-show-job-mem-per-gpu-running.json" 2>/dev/null \
  || rm -f "$OUT/scontrol-show-job-mem-per-gpu-running.json"
scancel "$h"; sleep 2
squeue --json --all --states=all > "$OUT/squeue-held-then-cancelled.json"
scontrol show job "$h" > "$OUT/scontrol-show-job-held-then-cancelled.txt"
scontrol requeuehold "$a"
for _ in $(seq 30); do squeue -h -j "$a" -o %T | grep -q PENDING && break; sleep 1; done
sleep 1
squeue --json --all --states=all > "$OUT/squeue-requeue-held.json"
scontrol show job "$a" > "$OUT/scontrol-show-job-requeue-held.txt"
squeue --noheader --states=all -O 'JobID:|,Reason:|,cpus-per-tres:|,mem-per-tres:|,tres-per-node:|' \
  > "$OUT/squeue-format.txt"
scancel "$a"; sleep 1
for c in "scancel --verbose $a" "scancel --verbose 999999" "scancel --signal=USR2 --full $a" "scontrol hold $a" \
         "scontrol release $a" "scontrol update JobId=$a NumNodes=1-1"; do
  echo "== $c"; $c 2>&1; echo "rc=$?"
done > "$OUT/finished-job-actions.txt"
echo "job ids: $a $h" >> "$OUT/finished-job-actions.txt"
