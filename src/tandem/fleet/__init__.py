"""Everything that places processes and moves things between them: Ray and placement groups,
the training workers, the rollout servers, the one weight-sync seam, spillover, served reward
pools and the start-up clock. The trainer keeps the order of phases and calls into `Fleet`."""
