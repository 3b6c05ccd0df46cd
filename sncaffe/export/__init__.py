"""Export a net to ONNX (onnx.py) and to PyTorch source (pytorch.py), each checked against
sncaffe on a random batch (check.py).

What is exported is the net's deploy part (deploy.py): data layers become inputs, loss,
Accuracy and Silence layers are dropped, and the outputs are the blobs no kept layer
consumes. A layer type without a mapping is refused by name (``ExportError``).
"""


class ExportError(ValueError):
    """A net that cannot be exported as asked: a layer type or setting without a mapping,
    or outputs that differ from sncaffe's by more than the tolerance."""
