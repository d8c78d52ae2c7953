// The refusal of a backward recorded for a second derivative (create_graph=True) whose
// incoming gradient was computed from the graph: the second derivative would flow back
// through the rule node's output, where it needs the forward's own Jacobian and the node
// has the rule's. The same words as pyattr/_function.py's check_second_order.
#pragma once

#define PYATTR_SECOND_PASS_MESSAGE                                                                           \
  "a second derivative (create_graph=True) would flow back through the output of one of pyattr's rule "      \
  "ops, whose node gives the rule's Jacobian where the derivative of the rule gradient needs the forward's "   \
  "own, so the result would not be that derivative. Second-order gradients are exact with respect to a rule " \
  "op's own input and a given incoming gradient only (identity_rule(x, act) with grad_outputs); through a "   \
  "model under use_relevance_rules, differentiate the rule gradient by finite differences, or take second "   \
  "derivatives outside the scope"
