"""``jaxrec train``: trains a recommendation model end to end (also ``python -m jaxrec train``).

    jaxrec train                                     DLRM on the synthetic click log (CPU, < 2 min)
    jaxrec train --data criteo:train.txt --steps 20000 --checkpoint-dir ckpt
    jaxrec train --data criteo:train.txt --vocab dynamic   each hex value its own id (_vocab.py)
    jaxrec train --data movielens:ml-100k --model mf --epochs 20
    jaxrec train --checkpoint-dir ckpt --resume      continue the newest checkpoint

Evaluations during training read a validation set (ratings: ``--val-fraction`` of the
training ratings; click data: ``--eval-batches`` batches), the run stops after
``--patience`` of them without a better metric, and the test set is evaluated once, at the
end, with the best model (its checkpoint is never rotated out).

At the end: ``out_dir/metrics.json`` (status, config, device, throughput, step stats, the
validation curve, the best point, the test metrics of the best model) and
``out_dir/curves.png``, also when a run stops on an error (a NaN/Inf step: the last finite
checkpoint is kept; ``--on-nonfinite skip`` skips such steps instead).
``train(TrainConfig(...))`` does the same from Python (``TrainingStopped`` when it stops).
A run locks its checkpoint directory; ``--resume`` applies new learning rates, weight decay
and patience, and refuses flags that change the model or the data.
"""

from jaxrec.train._cli import main
from jaxrec.train._config import TrainConfig
from jaxrec.train._loop import TrainingStopped, train

__all__ = ["TrainConfig", "TrainingStopped", "main", "train"]
