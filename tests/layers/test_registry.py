"""sncaffe.layers.REGISTRY holds every layer type BVLC Caffe registers (BVLC/caffe master, Caffe 1.0)."""
from sncaffe.layers import REGISTRY

BVLC_TYPES = {
    "AbsVal", "Accuracy", "ArgMax", "BNLL", "BatchNorm", "BatchReindex", "Bias", "Clip", "Concat",
    "ContrastiveLoss", "Convolution", "Crop", "Data", "Deconvolution", "Dropout", "DummyData", "ELU",
    "Eltwise", "Embed", "EuclideanLoss", "Exp", "Filter", "Flatten", "HDF5Data", "HDF5Output",
    "HingeLoss", "Im2col", "ImageData", "InfogainLoss", "InnerProduct", "Input", "LRN", "LSTM",
    "LSTMUnit", "Log", "MVN", "MemoryData", "MultinomialLogisticLoss", "PReLU", "Parameter", "Pooling",
    "Power", "Python", "RNN", "Reduction", "ReLU", "Reshape", "SPP", "Scale", "Sigmoid",
    "SigmoidCrossEntropyLoss", "Silence", "Slice", "Softmax", "SoftmaxWithLoss", "Split", "Swish", "TanH",
    "Threshold", "Tile", "WindowData",
}
# Types registered elsewhere and not yet here; empty: the test checks all 61 types.
OTHER_HELPERS = set()


def test_bvlc_type_list():
    assert len(BVLC_TYPES) == 61 and OTHER_HELPERS <= BVLC_TYPES


def test_registry_holds_every_bvlc_type():
    missing = sorted(BVLC_TYPES - OTHER_HELPERS - set(REGISTRY))
    assert not missing, f"layer types BVLC Caffe registers but sncaffe does not: {missing}"


def test_registry_names_match_classes():
    for name, cls in REGISTRY.items():
        assert cls.type == name
