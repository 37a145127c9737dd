"""hvddp.torch: placeholder until its adapter lands."""
