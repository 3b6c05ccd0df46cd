# The build is described in pyproject.toml; this file lets `python setup.py develop` work too.
from setuptools import setup

setup()
