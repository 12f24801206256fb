"""Megatron strategies behind ``fastckpt.integrations.megatron`` (a package, so the wheel ships it)."""
