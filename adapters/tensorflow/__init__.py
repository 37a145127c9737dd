"""hvddp.tensorflow: placeholder until its adapter lands."""
