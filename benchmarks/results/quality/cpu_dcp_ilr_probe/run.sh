set -x
cd /work/main; . /tmp/venv/bin/activate
D=.gpu/data/train_tok; P=/tmp/probe/pre
SHAPE="model.n_layers=2 model.d_model=128 model.n_heads=2 model.n_positions=256"
[ -d $P/checkpoints ] || fox-jax train --preset gpt2 --workdir $P --data $D --seq-len 256 --batch-size 8 --steps 300 --lr 1e-3 --warmup-steps 30 --dtype float32 --eval-every 0 --eval-batches 4 --log-every 50 --ckpt-every 300 --no-progress $SHAPE > /tmp/probe/pre.log 2>&1
for cfg in "3e-3 0" "3e-4 0" "3e-3 0.05" "3e-4 0.05"; do set -- $cfg
  fox-jax finetune-dcp --from-run $P --workdir /tmp/probe/ilr$1_g$2 --batch-size 8 --steps 150 --lr 3e-4 --interaction-lr $1 --gamma $2 --dtype float32 --dcp-impl xla --eval-every 0 --eval-batches 4 --log-every 25 --ckpt-every 150 --no-progress > /tmp/probe/ilr$1_g$2.log 2>&1
done
