#!/usr/bin/env bash
# Make the LeNet example's LMDBs from the MNIST test set shipped here (10,000 images):
# the first 8,000 for training, the last 2,000 held out. Run from the repository root:
#     bash data/mnist/create_mnist.sh
set -euo pipefail
DATA=data/mnist
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
IMAGES=$DATA/t10k-images-idx3-ubyte.gz
LABELS=$DATA/t10k-labels-idx1-ubyte.gz

for db in mnist_train_lmdb mnist_test_lmdb; do
    if [ -e "$DATA/$db" ]; then
        echo "Removing the old $DATA/$db."
        rm -rf "${DATA:?}/$db"
    fi
done
"$PYTHON" tools/convert_mnist_data.py "$IMAGES" "$LABELS" "$DATA/mnist_train_lmdb" --start 0 --count 8000
"$PYTHON" tools/convert_mnist_data.py "$IMAGES" "$LABELS" "$DATA/mnist_test_lmdb" --start 8000 --count 2000
echo "Done."
