"""Every loss llm_train computes, and the one interface the engines call: open this package first.

    interface.py          `Objective.score(model, batch) -> Scored` (the loss to backpropagate, the loss and
                          metrics to log), `mean_scores`: what the ZeRO engine calls for every micro-batch
    objective_losses.py   `make_objective`: the recipe's `objective:` -> the Objective below
    language_modeling.py  lm: the model's own loss (whole rows), a sequence-parallel rank's share of its
                          group's loss, and the pipeline's last-stage losses (`causal_lm_loss`, chunked)
    chunked.py            memory.tiled_loss: per-token log-probs without the full logits, chunk by chunk
                          (the model's patched forward, DPO's sums and the pipeline's chunked loss use it)
    preference_tuning.py  dpo and simpo on pairs of rows
    reward.py             reward: Bradley-Terry on a classifier's scores
    grpo.py               grpo's arithmetic: group advantages and the clipped policy loss (the rollouts
                          and the Objective that runs them: runtime/rl/grpo.py)

An engine hands its model and batch to the objective (ZeRO) or gives DeepSpeed's pipeline schedule the last
stage's loss function (pipeline); the step loop (runtime/loop.py) sees only the means.
"""
