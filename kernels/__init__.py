"""The speed and no-TE kit: one module per patch group (qvl.foundation.patches), named after it."""
