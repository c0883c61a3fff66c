"""Model families as data: the families table, which layers hold routed experts, the config resolver and
the tensor-name parser. Pure data and maths; imports only `formats` below it."""
