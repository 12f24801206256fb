"""DeepSpeed engine hooks behind ``fastckpt.integrations.deepspeed`` (a package, so the wheel ships it)."""
