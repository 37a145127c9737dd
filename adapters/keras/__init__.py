"""hvddp.keras: placeholder until its adapter lands."""
