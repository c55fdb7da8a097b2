"""A verl-style reward: the last number of the response must equal the ground truth."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+", solution_str)
    correct = bool(numbers) and numbers[-1] == str(ground_truth)
    return {"score": float(correct), "acc": float(correct)}
