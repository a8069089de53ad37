"""The MLP classifier: the model (``model.py``) and its tensor-parallel plan beside it (``plan.py``).

    model.py   MLP (``self.layers``: Flatten, Linear, ReLU, ..., Linear), classification_loss;
               knows nothing of parallelism
    plan.py    mlp_tp_plan: its Linear layers paired column / row

``from distrain.models.mlp import MLP`` reads the model; ``mlp_tp_plan`` is imported from
plan.py on first use only (it brings tensor parallelism with it).
"""

from distrain.models.mlp.model import MLP, classification_loss


def __getattr__(name):  # the plan (and tensor parallelism) is imported on first use only
    if name == "mlp_tp_plan":
        from distrain.models.mlp import plan

        return plan.mlp_tp_plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MLP", "classification_loss", "mlp_tp_plan"]
