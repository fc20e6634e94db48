#!/bin/bash
# Do restarted workers join under torchrun? N trials of two torchrun agents on 127.0.0.1
# (--max-restarts 1, one worker each) training PipeDream on 2 stages for 40 updates with a
# checkpoint every 5; in each, one worker is killed (SIGKILL, fault injection) before a random
# action of its program, and the trial counts as finished when the restarted job wrote its model.
# Prints each trial, with the first join error seen in its logs, and the count.
#
# usage: benchmarks/torchrun_restarts.sh SRC N LABEL     (SRC: the pipetrain sources to run)
# e.g.   PYTHON=.venv/bin/python benchmarks/torchrun_restarts.sh src 6 branch
SRC=$(cd "$1" && pwd); N=$2; LABEL=$3
PYTHON=${PYTHON:-python}
WORK=$(mktemp -d)
ok=0
for i in $(seq 1 "$N"); do
  D=$WORK/trial-$i
  export PYTHONPATH=$SRC OMP_NUM_THREADS=1
  PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  mkdir -p "$D"
  POS=$((20 + RANDOM % 60)); RANK=$((RANDOM % 2))
  for node in 0 1; do
    PIPETRAIN_FAULT_INJECT=$RANK:$POS timeout 300 "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
      --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$PORT --rdzv-id job \
      --rdzv-conf is_host=$((1 - node)),join_timeout=60 --max-restarts 1 --monitor-interval 0.1 \
      -m pipetrain.cli train --executor distributed --schedule pipedream --stages 2 --model mlp:depth=3,width=16 \
      --data synthetic:features=8,classes=3,samples=96 --batch-size 4 --steps 40 --no-progress --timeout 30 \
      --checkpoint-dir "$D/ck" --checkpoint-every 5 --save "$D/model.pt" > "$D/node$node.log" 2>&1 &
  done
  wait
  if grep -q "wrote model" "$D"/node*.log; then ok=$((ok + 1)); r=ok; else r=FAILED; fi
  echo "$LABEL trial $i (rank $RANK killed before position $POS): $r $(grep -ho 'connectFullMesh failed[^,]*\|could not join[^(]*' "$D"/node*.log | head -1)"
done
rm -rf "$WORK"
echo "$LABEL: $ok of $N restarts finished"
