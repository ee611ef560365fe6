"""The step-time goal under the bench's tables, (F + 2B) / (F + B): printed with its noise (the mean and 95%
t-interval over repeated measurements), never from one measurement (which moved from 1.64 to 1.41 between two runs
minutes apart)."""

import torch

from mtl.bench.doctor import step_goals
from mtl.bench.stats import mean_ci
from mtl.bench.tables import goal_text


def test_the_goal_is_printed_with_its_interval_over_the_measurements():
    goals = [1.64, 1.41, 1.55, 1.60, 1.47]
    text = goal_text(80.0, 130.0, goals)
    mean, half = mean_ci(goals)
    assert f"(F + 2B) / (F + B): {mean:.2f} [{mean - half:.2f}, {mean + half:.2f}]" in text
    assert "over 5 measurements" in text and "range 1.41-1.64" in text
    assert half > 0.05  # these measurements' noise is visible in the interval


def test_no_goal_from_fewer_than_three_measurements():
    for goals in ([], [1.64], [1.64, 1.41]):
        text = goal_text(80.0, 130.0, goals)
        assert "is not given" in text and "[" not in text
        assert "1.64" not in text  # the single measurement is not printed as the goal


def test_step_goals_measures_each_repetition_of_a_model():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, batch):
            return {"losses": {"a": self.lin(batch["x"]).pow(2).mean(), "b": self.lin(batch["x"]).abs().mean()}}

    goals = step_goals(Tiny(), {"x": torch.randn(8, 16)}, reps=4)
    assert len(goals) == 4 and all(1.0 < g < 2.0 for g in goals)  # (F + 2B) / (F + B) lies in (1, 2) for B > 0
