"""`OneRank`: the learner's step-wide collectives for a group of one rank, without torch.distributed."""

import torch


class OneRank:
    """`learner.objective.Collectives` of a data-parallel group of one rank."""

    rank, world = 0, 1

    def sum_(self, x):
        return x

    def kth_largest(self, values, k):
        return self.top_values(values, k)[-1]

    def top_values(self, values, k):
        ordered = values.double().sort(descending=True).values[:k]
        return torch.cat([ordered, torch.full((k - ordered.numel(),), float("-inf"), dtype=torch.float64)])
