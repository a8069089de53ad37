"""Checkpoints: every way a run's state goes to disk and comes back, in one package.

    form.py       the whole-model form: state by parameter name, whatever the layout (one format for
                  consolidation, resharding, elastic ZeRO pieces and ZeRO's full_state_dict)
    store.py      files written atomically, read without running pickled code; checkpoint SETS
                  committed by one manifest (save_set, read_manifest, load_shard, verify)
    reshard.py    a set of any layout <-> the whole-model form (consolidate; an elastic job's pieces);
                  the naming record each shard carries; the form cut for one rank of any layout
    read.py       reading a checkpoint file or a Hugging Face folder, checked for form
    models.py     a file's tensors against the model a run trains (names, shapes, tied weights)
    write.py      a run folder whose committed checkpoint is given weights (`checkpoint import`)
    hf.py         Hugging Face Llama folders in (`import --hf`) and out (`export`)
    init_from.py  `train --init-from SOURCE`: which model a run builds, and its starting weights

The trainer calls this package (its loop saves and resumes sets, its engines record and load
shards); it never imports the trainer. The store's functions are this package's own names:
``from distrain import checkpoint; checkpoint.save_set(...)``.
"""

from distrain.checkpoint.store import (FORMAT_VERSION, MANIFEST, CheckpointWriteError, clean_temporaries, load,
                                       load_shard, read_manifest, save, save_set, sha256, shard_file, verify,
                                       write_manifest)

__all__ = ["FORMAT_VERSION", "MANIFEST", "CheckpointWriteError", "clean_temporaries", "load", "load_shard",
           "read_manifest", "save", "save_set", "sha256", "shard_file", "verify", "write_manifest"]
