"""Caffe's 01-learning-lenet loop, as a pycaffe user writes it (only the import line changed)."""
import numpy as np

import sncaffe.pycaffe as caffe
from pycaffe_fixtures import lenet_fixture  # noqa: F401 (fixtures)


def test_lenet_training_loop_with_solver_step(lenet):
    caffe.set_mode_cpu()
    solver = caffe.SGDSolver(str(lenet["solver"]))
    shapes = [(k, v.data.shape) for k, v in solver.net.blobs.items()]
    assert ("conv1", (64, 20, 24, 24)) in shapes and ("label", (64,)) in shapes
    assert [(k, v[0].data.shape) for k, v in solver.net.params.items()][0] == ("conv1", (20, 1, 5, 5))
    solver.net.forward()                 # train net
    solver.test_nets[0].forward()        # test net (there can be more than one)

    niter, test_interval = 40, 20
    train_loss = np.zeros(niter)
    test_acc = np.zeros(int(np.ceil(niter / test_interval)))
    output = np.zeros((niter, 8, 10))
    for it in range(niter):
        solver.step(1)                   # SGD by Caffe
        train_loss[it] = solver.net.blobs["loss"].data
        solver.test_nets[0].forward(start="conv1")      # the same batch, from conv1 on
        output[it] = solver.test_nets[0].blobs["ip2"].data[:8]
        if it % test_interval == 0:
            correct = 0
            for test_it in range(2):
                solver.test_nets[0].forward()
                correct += sum(solver.test_nets[0].blobs["ip2"].data.argmax(1)
                               == solver.test_nets[0].blobs["label"].data)
            test_acc[it // test_interval] = correct / 200
    assert solver.iter == niter
    assert train_loss[-5:].mean() < 0.6 * train_loss[:5].mean()
    assert test_acc[-1] > 0.6 and test_acc[-1] > test_acc[0]
    assert not np.allclose(output[0], output[-1])       # the test net shares the trained weights
    assert np.abs(solver.net.params["conv1"][0].diff).sum() > 0


def test_solvers_by_class_and_by_file(lenet, tmp_path):
    text = lenet["solver"].read_text()
    (tmp_path / "adam.prototxt").write_text(text.replace("momentum: 0.9", 'type: "Adam" momentum: 0.9 momentum2: 0.999')
                                            .replace("base_lr: 0.01", "base_lr: 0.001"))
    s = caffe.get_solver(str(tmp_path / "adam.prototxt"))
    assert s._solver.param.type == "Adam"
    s.step(2)
    assert s.iter == 2
    for cls, rule in ((caffe.NesterovSolver, "Nesterov"), (caffe.AdamSolver, "Adam"), (caffe.SGDSolver, "SGD")):
        s = cls(str(tmp_path / "adam.prototxt"))
        assert s._solver.param.type == rule and s._solver.rule.type == rule


def test_snapshot_and_restore(lenet):
    solver = caffe.SGDSolver(str(lenet["solver"]))
    solver.step(3)
    solver.snapshot()
    w = solver.net.params["ip2"][0].data.copy()
    prefix = lenet["dir"] / "snap/lenet"
    solver.step(2)
    again = caffe.SGDSolver(str(lenet["solver"]))
    again.restore(f"{prefix}_iter_3.solverstate")
    assert again.iter == 3
    np.testing.assert_array_equal(again.net.params["ip2"][0].data, w)
    again.step(2)
    assert again.iter == 5 and not np.array_equal(again.net.params["ip2"][0].data, w)
