"""The Tinker API served by dualrl: the official ``tinker`` SDK (0.38.0) trains and samples a
dualrl policy on any backend (``dualrl serve``; docs/tinker.md).

Modules, from the wire inwards: ``app`` (the HTTP routes), ``service`` (each call checked,
then answered or queued), ``jobs`` (futures, the runner thread), ``registry`` (sessions,
models, samplers), ``datums`` / ``sampling`` / ``wire`` (requests and results), ``model``
(one model's policy), ``runtime`` (the base model, Ray, the cluster), ``config``, ``serve``
(the command).  Backend-agnostic: the policy is ``core.policy.Policy``, the losses
``core.losses.tinker_losses``.
"""
