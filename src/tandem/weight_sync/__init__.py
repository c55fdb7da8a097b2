"""Weight sync: checkpoint engines that move the actor's weights into the rollout engine."""
