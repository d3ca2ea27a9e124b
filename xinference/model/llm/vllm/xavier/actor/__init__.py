"""The transfer actor (one per replica) and the parts it is made of."""
