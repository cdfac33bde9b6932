"""``jaxrec train``: trains a recommendation model end to end (also ``python -m jaxrec train``).

    jaxrec train                                     DLRM on the synthetic click log (CPU, < 2 min)
    jaxrec train --data criteo:train.txt --steps 20000 --checkpoint-dir ckpt
    jaxrec train --data movielens:ml-100k --model mf --epochs 20
    jaxrec train --checkpoint-dir ckpt --resume      continue the newest checkpoint

At the end: ``out_dir/metrics.json`` (config, device, throughput, every evaluation) and
``out_dir/curves.png``. ``train(TrainConfig(...))`` does the same from Python.
"""

from jaxrec.train._cli import main
from jaxrec.train._config import TrainConfig
from jaxrec.train._loop import train

__all__ = ["TrainConfig", "main", "train"]
