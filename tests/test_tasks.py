"""The Boolean GOTU tasks against their definitions (the paper's Section 5.1; the tasks of aryol/GOTU)."""
import pytest
import torch

import tasks

CUBE = tasks.boolean_cube()


def test_cube_is_every_point_once():
    assert CUBE.shape == (2 ** 15, 15)
    assert set(CUBE.unique().tolist()) == {-1.0, 1.0}
    assert len(torch.unique(CUBE, dim=0)) == 2 ** 15
    assert torch.equal(tasks.boolean_tokens(CUBE).unique(), torch.tensor([0, 1]))


@pytest.mark.parametrize("name, seen_fraction", [
    ("2parity", 3 / 4), ("majority", 3 / 4), ("cyclic3", 7 / 8), ("threesym", 1 / 2)])
def test_seen_domain_and_dataset(name, seen_fraction):
    data = tasks.boolean_dataset(name)
    assert len(data["x_train"]) == seen_fraction * 2 ** 15
    assert len(data["x_test"]) == 2 ** 15 and data["unseen"].float().mean() == 1 - seen_fraction
    task = tasks.boolean_task(name, data["x_train"])
    assert task.seen.all()
    torch.testing.assert_close(data["y_train"], task.target)


def test_targets_match_their_definitions_pointwise():
    x = CUBE[torch.randperm(len(CUBE), generator=torch.Generator().manual_seed(0))[:200]]
    for row, f2, fm, fc, ft in zip(x.tolist(), *(tasks.boolean_task(n, x).target.tolist()
                                               for n in ("2parity", "majority", "cyclic3", "threesym"))):
        assert f2 == row[0] * row[1]
        assert fm == (1 if row[0] + row[1] + row[2] > 0 else -1)
        assert fc == sum(row[i] * row[(i + 1) % 15] * row[(i + 2) % 15] for i in range(15))
        assert ft == pytest.approx(row[0] * row[1] - 1.25 * row[1] * row[2] + 1.5 * row[2] * row[0])


@pytest.mark.parametrize("name", list(tasks.BOOLEAN_TASKS))
def test_mdi_agrees_on_seen_and_not_on_unseen(name):
    task = tasks.boolean_task(name, CUBE)
    seen, f, mdi = task.seen, task.target, task.mdi
    torch.testing.assert_close(mdi[seen], f[seen])
    assert (mdi[~seen] != f[~seen]).any()


@pytest.mark.parametrize("name", list(tasks.BOOLEAN_TASKS))
def test_target_takes_only_its_listed_values(name):
    values = tasks.BOOLEAN_TASKS[name]
    if values is not None:
        assert set(tasks.boolean_task(name, CUBE).target.unique().tolist()) <= set(values)


@pytest.mark.parametrize("name, test_loss, unseen_loss, test_acc", [
    ("2parity", 4.0, 16.0, 75.0),      # unseen: the MDI x0 + x1 - 1 is -3 where f = 1: error 16
    ("threesym", 9.625, 19.25, None),  # unseen: f = -MDI, error 4 (1 + 1.25^2 + 1.5^2); no accuracy
    ("majority", 1.0, 4.0, 87.5),      # unseen: MDI = 2 x2 - 1 is 1 or -3 where f = -1: error 4
    ("cyclic3", 8.0, 64.0, 87.5),      # unseen: the MDI gives 7 where x0 x1 x2 = -1
])
def test_mdi_scores_through_our_metrics(name, test_loss, unseen_loss, test_acc):
    metrics = tasks.boolean_metrics(name, tasks.boolean_task(name, CUBE).mdi, CUBE)
    assert metrics["test_loss"] == pytest.approx(test_loss)
    assert metrics["unseen_loss"] == pytest.approx(unseen_loss)
    assert metrics["unseen_mse_to_mdi"] == 0
    assert metrics["test_acc"] == (None if test_acc is None else pytest.approx(test_acc))


@pytest.mark.parametrize("name", list(tasks.BOOLEAN_TASKS))
def test_target_scores_perfectly(name):
    metrics = tasks.boolean_metrics(name, tasks.boolean_task(name, CUBE).target, CUBE)
    assert metrics["test_loss"] == 0 and metrics["unseen_loss"] == 0
    assert metrics["unseen_mse_to_mdi"] > 0
    if tasks.BOOLEAN_TASKS[name] is not None:
        assert metrics["test_acc"] == 100 and metrics["unseen_acc"] == 100


def test_accuracy_rounds_to_the_nearest_possible_value():
    values = tasks.BOOLEAN_TASKS["cyclic3"]
    pred = torch.tensor([0.9, -0.2, 2.1, 14.0, -20.0])
    nearest = [1.0, -1.0, 3.0, 13.0, -15.0]
    for i, value in enumerate(nearest):     # right exactly when the truth is the nearest possible value
        assert tasks.boolean_accuracy(pred[i:i + 1], torch.tensor([value]), values) == 100
        assert tasks.boolean_accuracy(pred[i:i + 1], torch.tensor([value + 2]), values) == 0
    assert tasks.boolean_accuracy(pred, torch.tensor([1.0, -1.0, 1.0, 15.0, -15.0]), values) == pytest.approx(60.0)
    assert tasks.boolean_accuracy(pred, pred, None) is None


def test_fourier_coefficients_of_majority():
    """Maj(x0, x1, x2) = (x0 + x1 + x2 - x0 x1 x2) / 2 (Section 5.1)."""
    coeffs = tasks.fourier_coefficients(tasks.boolean_task("majority", CUBE).target, CUBE)
    expected = {"1": 0, "x0": 0.5, "x1": 0.5, "x2": 0.5, "x0x1": 0, "x0x2": 0, "x1x2": 0,
                "x0x1x2": -0.5}
    assert coeffs == pytest.approx(expected, abs=1e-12)
    mdi = tasks.fourier_coefficients(tasks.boolean_task("majority", CUBE).mdi, CUBE)
    assert mdi == pytest.approx({"1": 0, "x0": 0.5, "x1": 0.5, "x2": 1, "x0x1": 0, "x0x2": -0.5,
                                 "x1x2": -0.5, "x0x1x2": 0}, abs=1e-12)
