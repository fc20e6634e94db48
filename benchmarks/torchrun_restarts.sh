#!/bin/bash
# usage: trials.sh SRC N LABEL
SRC=$1; N=$2; LABEL=$3
ok=0
for i in $(seq 1 $N); do
  D=/tmp/f1/trial-$LABEL-$i
  export PYTHONPATH=$SRC OMP_NUM_THREADS=1
  PORT=$(/work/main/.venv/bin/python -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
  rm -rf $D; mkdir -p $D
  POS=$((20 + RANDOM % 60)); RANK=$((RANDOM % 2))
  for node in 0 1; do
    PIPETRAIN_FAULT_INJECT=$RANK:$POS timeout 300 /work/main/.venv/bin/python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$PORT --rdzv-id job --rdzv-conf is_host=$((1-node)),join_timeout=60 --max-restarts 1 --monitor-interval 0.1 -m pipetrain.cli train --executor distributed --schedule pipedream --stages 2 --model mlp:depth=3,width=16 --data synthetic:features=8,classes=3,samples=96 --batch-size 4 --steps 40 --no-progress --timeout 30 --checkpoint-dir $D/ck --checkpoint-every 5 --save $D/model.pt > $D/node$node.log 2>&1 &
  done
  wait
  if grep -q "wrote model" $D/node*.log; then ok=$((ok+1)); r=ok; else r=FAILED; fi
  echo "$LABEL trial $i (rank $RANK killed before position $POS): $r $(grep -ho 'connectFullMesh failed[^,]*\|could not join[^(]*' $D/node*.log | head -1)"
done
echo "$LABEL: $ok of $N restarts finished"
