"""SegNet's DenseImageData: image and label pairs in list order, crop and mirror moving both alike."""
import numpy as np
import pytest

from sncaffe.data import image
from sncaffe.graph import GraphError

from test_dataset import batches, images, net_of


def pairs(tmp_path, n, shape=(3, 6, 8)):
    """n images and label images whose label is the image's first channel mod 5 (so a test can
    tell that both moved alike); the list file."""
    xs = images(n, shape)
    labs = xs[:, :1] % 5
    lines = []
    for i in range(n):
        (tmp_path / f"x{i}.png").write_bytes(image.encode(xs[i]))
        (tmp_path / f"y{i}.png").write_bytes(image.encode(labs[i]))
        lines.append(f"x{i}.png y{i}.png")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    return xs, labs


def dense_net(tmp_path, params="", extra=""):
    return net_of(f'type: "DenseImageData" {extra} dense_image_data_param {{ source: "{tmp_path}/list.txt" '
                  f'root_folder: "{tmp_path}/" batch_size: 2 {params} }}')


def test_dense_image_data_in_list_order(tmp_path):
    xs, labs = pairs(tmp_path, 3)
    net = dense_net(tmp_path, extra="transform_param { scale: 0.5 }")
    for b, rows in zip(batches(net, 2), ([0, 1], [2, 0])):
        np.testing.assert_array_equal(b["data"], xs[rows] * np.float32(0.5))
        np.testing.assert_array_equal(b["label"], labs[rows])
    net.layers[0].close()


def test_dense_image_data_crops_and_mirrors_image_and_label_alike(tmp_path):
    pairs(tmp_path, 3)
    net = dense_net(tmp_path, "crop_height: 4 crop_width: 5 mirror: true")
    for b in batches(net, 4):
        assert b["data"].shape == (2, 3, 4, 5) and b["label"].shape == (2, 1, 4, 5)
        np.testing.assert_array_equal(b["label"], b["data"][:, :1] % 5)
    net.layers[0].close()


def test_dense_image_data_refuses_what_would_split_the_pair(tmp_path):
    pairs(tmp_path, 2)
    with pytest.raises(GraphError, match="would move image and label apart"):
        dense_net(tmp_path, extra="transform_param { mirror: true }")
    (tmp_path / "list.txt").write_text("x0.png\n")
    with pytest.raises(GraphError, match=r'list.txt line 1: expected "image label_image"'):
        dense_net(tmp_path)
