"""Caffe's tools, installed as commands (pyproject [project.scripts]): convert_imageset,
compute_image_mean, convert_mnist_data, extract_features, parse_log."""
