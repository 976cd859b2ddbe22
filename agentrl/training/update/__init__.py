"""The maths on one training batch: token rows from episodes, advantages, log-probs, the PPO update, packing."""
